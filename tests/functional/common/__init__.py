"""Test package (importable as tests.functional.common for shared helpers)."""
