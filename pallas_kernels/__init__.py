"""Pallas kernels that read keys and values through block tables, each beside its plain-jnp reference.

This package imports nothing from jpaged: kernels are pure functions of arrays.
"""
