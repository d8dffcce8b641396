"""A small Django project for tests/contrib/test_django.py (settings from the environment)."""
