"""Images: `dataset=image_folder` (a folder of photos, cached or decoded whole per sample) and
`dataset=streaming` (image shards), their decoder and per-sample recipe, and the batch-wise
mixing (mixup, cutmix, random erasing) of image batches."""
