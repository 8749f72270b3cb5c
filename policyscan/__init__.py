"""policyscan: batch compliance classification of chatbot logs, per policy calibrated probabilities."""
