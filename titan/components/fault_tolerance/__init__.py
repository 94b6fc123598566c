"""Surviving faults: torchft replica groups, watchdog, injected faults for tests."""
