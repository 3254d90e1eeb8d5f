"""Data: what a `dataset` option builds (Splits), the loaders and their orders, and the device
transform, at this package's root, with what every modality shares (crops, the class-folder
tree); one sub-package per modality (images/, video/, text/), and the sources any modality reads
through (shards/: shard sets; remote/: loader=ray). No modality imports another
(tests/test_architecture.py); docs/architecture.md says where a new one goes."""
