"""Tests of structure."""
