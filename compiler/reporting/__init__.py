"""What a compile reports: the report itself, its HTML page, and the steps of long work."""
