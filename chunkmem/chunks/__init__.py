"""Model data in chunks: states, layouts, the parameter store, residency on the device, placement plans."""
