"""Tests of the timeslice client library and CLI (client/timeslice)."""
