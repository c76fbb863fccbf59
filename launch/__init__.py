"""Command-line launcher: start the engine, make the demo model."""
