"""The command lines (console scripts): palimpsa-train, palimpsa-sweep, palimpsa-demo."""
