"""Pure checks behind Preflight: what a rank reports, how ranks' facts are compared, launch variables, setup warnings."""
