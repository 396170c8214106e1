"""Running a sweep: experiment file → points → one isolated process per point → rows."""
