"""The outbox tests: a package, so that its conftest and helpers are modules of their own."""
