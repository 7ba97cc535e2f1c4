"""capsafe's harness: a pytest plugin and the `capsafe sweep` command."""
