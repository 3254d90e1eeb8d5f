"""Medical volumes: `dataset=volume_folder` (NIfTI in the Medical Segmentation Decathlon's or
nnU-Net v2's layout, read through MONAI's LoadImaged), the deterministic preprocessing done
once and cached (in memory or on disk), and the random patches drawn each step."""
