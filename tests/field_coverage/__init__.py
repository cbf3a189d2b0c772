"""The sections of tests/field_coverage_table.py, one module each."""
