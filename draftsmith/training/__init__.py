"""Training the EAGLE-3 draft with speculators' Trainer: the draft model, the CPU attention stand-in, resume."""
