"""Tests of the planner (plait.plan): pure arithmetic, except the calibration."""
