"""Placeholder: see the open issues."""
