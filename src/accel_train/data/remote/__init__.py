"""`loader=ray`: the input pipeline on a Ray cluster's CPUs (the loader, with the order kept in
the training process, and the pool of actors that makes the batches). Imports no modality: the
actors run whatever split and collate they are handed."""
