"""Hidden-state extraction: one driver (journal, progress, manifest, validation) and its backends."""
