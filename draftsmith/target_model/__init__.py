"""The target model: its spec (path, revision, trust_remote_code, dtype), layers, and the embedded default target."""
