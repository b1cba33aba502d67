"""What serving itself costs, measured on real processes: the scheduler's step, the gateway per
streamed token, ``ferry serve`` against the offline engine, OpenMP wait policies, data parallel,
two engines under load with one killed, and authentication under a flood of keyless requests."""
