"""dmuon: owner-centric distributed Muon (single-device Muon, DMuon, NaiveMuon) and its plan."""

__version__ = "0.1.0"
