"""Benchmarks and calibration: measured figures to compare with theory and the planner.

* :mod:`plait.bench.comm` — the point-to-point all-reduce algorithms and the library's,
  with the alpha-beta model fitted to them (``plait bench comm``);
* :mod:`plait.bench.calibrate` / :mod:`plait.bench.measure` — this machine's compute
  rates and collectives' alpha and beta, written as a hardware profile for
  ``plait plan --hardware PATH`` (``plait bench calibrate``);
* :mod:`plait.bench.alphabeta`, :mod:`plait.bench.timing`, :mod:`plait.bench.results` —
  fitting, timing and the shared results file of ``benchmarks/``;
  :mod:`plait.bench.step_stamps` — when each step of a run in another process finished.

The command line is :mod:`plait.cli.bench`.
"""
