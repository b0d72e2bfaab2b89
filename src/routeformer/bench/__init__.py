"""Speed and memory measurement against reference implementations."""
