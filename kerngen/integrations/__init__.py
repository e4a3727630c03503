"""Integrations of kerngen into other libraries' model code, imported on demand (never by `import kerngen`)."""
