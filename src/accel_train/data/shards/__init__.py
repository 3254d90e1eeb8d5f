"""Shard sets: what `accel-data shard` writes and every streaming option reads, whatever the
modality: the shard set's index and checks, the object store behind it (S3), and the LitData
source, splits and training loader with its exact mid-epoch resume. Imports no modality: each
modality's streaming option (data/images/streaming.py, data/video/streaming.py,
data/text/streaming_*.py) hands it the decoder of its own items."""
