"""Inferno's compute kernels: plain-torch reference ops now, Triton kernels (issue #3) that must
match them."""
