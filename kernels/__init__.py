"""Inferno's compute kernels: the plain-torch reference ops (`reference`), the Triton kernels that
must match them, and `backend`, which picks one set for a device."""
