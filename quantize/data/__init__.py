"""quantize/data"""
