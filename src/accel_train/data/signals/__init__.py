"""Signals (issue 64): audio by torchcodec, windows of arrays (npy, npz, HDF5), the device
features."""
