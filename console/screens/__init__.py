"""The console's screens: one per mode, plus the help screen."""
