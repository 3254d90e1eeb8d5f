"""Video: `dataset=video_folder` (video files in class folders or lists) and
`dataset=streaming_video` (video shards), their decoding through torchcodec, the clips' geometry
in time and space, and the metadata cache kept between runs."""
