"""What serving itself costs, measured on real processes: the scheduler's step, the gateway per
streamed token, ``ferry serve`` against the offline engine, OpenMP wait policies, data parallel,
and two engines under load with one killed."""
