"""What keeps a run alive and honest while it trains: the process group, the run directory and its
lock, stop signals, bad-step decisions, hang and straggler detection, and failures said in one line."""
