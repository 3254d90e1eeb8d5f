"""Data: what a `dataset` option builds (Splits), the two loaders, and the device transform."""
