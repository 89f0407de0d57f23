"""`kvpool replay`: workloads, the replay driver, reports."""
