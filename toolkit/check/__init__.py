"""The cross-check: run every backend, compare stage by stage, golden files, node localisation, reports, and the
driver (`driver.run_check`) that `toolkit check` calls."""
