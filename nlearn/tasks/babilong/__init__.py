"""BABILong-style bAbI qa1-qa3: facts scattered through corpus text (`data`) and BABILong's answer check (`score`)."""
