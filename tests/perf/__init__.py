"""Tests of perf."""
