"""Internals of the mme-gpu container: configuration, MMS supervision, the GPU-aware backend and the handler.

Importing this package (or any module in it) never initialises CUDA: the backend server imports it before fork.
"""
