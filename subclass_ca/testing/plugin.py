"""pytest plugin for subclass_ca (fixtures arrive with the testing kit)."""
