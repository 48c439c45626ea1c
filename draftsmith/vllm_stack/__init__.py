"""The production stack: compatibility fixes for speculators 0.3.0 on the installed vLLM, and preflight checks."""
