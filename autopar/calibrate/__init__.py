"""Calibration: measuring this machine (``autopar profile``: kernels and collectives), reading
profiled runs (trace summaries, the profiler window of ``autopar run --profile``) and fitting
the cost model's figures to them (``fit``, ``recalibrate``). Above search: it replays plans;
nothing below imports it."""
