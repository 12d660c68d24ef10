"""Tests of the ``bench`` package: its sections at tiny shapes, reports and comparisons."""
