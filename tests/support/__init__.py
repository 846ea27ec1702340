"""Helpers shared by the test modules of unit/ and e2e/ (imported as ``support.<module>``)."""
