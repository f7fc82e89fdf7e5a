"""MQAR (multi-query associative recall): windows generated on the fly (`data`) and their recall score (`score`)."""
