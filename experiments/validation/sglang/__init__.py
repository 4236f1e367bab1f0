"""The differential checks against SGLang's own code, 0.4.10 and 0.5.23 (`check`)."""
