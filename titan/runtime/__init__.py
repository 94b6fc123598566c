"""What every titan process has, whatever it runs: its console and log lines, signal handling,
the record of a final error, the process group and device, and the repo's paths and dtype
names."""
