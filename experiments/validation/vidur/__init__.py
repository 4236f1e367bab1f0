"""The checks against Vidur 0.0.26 (MLSys 2024): our simulator against Vidur on the same Azure
requests (`compare`, ``python -m experiments.validation.vidur``; each Vidur run is `drive`, run by
file path in Vidur's own virtual environment), and the roofline's efficiencies fitted to Vidur's
A100 profile (`roofline`, ``python -m experiments.validation.vidur.roofline``)."""
