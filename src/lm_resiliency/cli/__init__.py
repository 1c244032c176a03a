"""The ``lm-resiliency`` command line."""
