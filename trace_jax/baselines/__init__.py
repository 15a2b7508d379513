"""The baselines of TRACE's comparison that are not TRACE's own stages: GEPA prompt optimisation (`gepa`)."""
