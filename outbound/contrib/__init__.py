"""Integrations with other libraries, each behind an optional extra.

Importing ``outbound.contrib.<name>`` imports that library; the error names
the extra to install when it is missing.
"""
